"""`python -m speechattn.superb ...`: see `speechattn.superb.run`."""

from speechattn.errors import command_line_errors
from speechattn.superb.run import main

if __name__ == "__main__":
    with command_line_errors(prog="python -m speechattn.superb"):
        main()
