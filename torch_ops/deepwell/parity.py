"""`python -m deepwell.parity`: one model trained per recipe on the same data; the loss curves in one
plot and the final-loss gaps to bf16 in a table (deepwell.train.parity)."""

from __future__ import annotations

from .train.parity import main

if __name__ == "__main__":
    main()
