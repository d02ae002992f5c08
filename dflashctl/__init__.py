"""dflashctl: deploy, launch, watch and kill DFlash drafter training jobs on remote GPU boxes."""

__version__ = "0.1.0"
