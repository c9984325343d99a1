"""`accelerate launch -m draftsmith.train RECIPE [key=value ...]`: the same trainer as `draftsmith train`."""

import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
