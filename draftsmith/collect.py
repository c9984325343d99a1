"""`accelerate launch -m draftsmith.collect RECIPE [key=value ...]`: the same job as `draftsmith collect`
(train/collect.py)."""

import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["collect", *sys.argv[1:]]))
