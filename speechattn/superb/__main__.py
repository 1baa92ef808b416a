"""`python -m speechattn.superb ...`: see `speechattn.superb.run`."""

from speechattn.superb import run_command
from speechattn.superb.run import main

if __name__ == "__main__":
    run_command(main)
