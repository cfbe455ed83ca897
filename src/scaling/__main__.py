import sys

from src.runs import usage_errors_exit
from src.scaling.cli import parse

with usage_errors_exit():
    args = parse(sys.argv[1:])  # before torch: --help and a mistake answered at once
    from src.scaling.predict import run  # torch and the model: once the command line has passed
    run(args)
