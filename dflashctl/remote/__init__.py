"""Where commands run: the transport (ssh, containers), deploys, and the agents shipped to the remote."""
