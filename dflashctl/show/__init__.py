"""What the user sees: the live view, terminal output, reports and plots."""
