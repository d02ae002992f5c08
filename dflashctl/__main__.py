from dflashctl.cli import run

run()
