"""The bundled DFlash drafter trainer. Imports nothing from dflashctl: the two meet through files."""
