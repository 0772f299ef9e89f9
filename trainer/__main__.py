"""`python -m trainer`: one training worker."""

from trainer.engine.loop import main

if __name__ == "__main__":
    raise SystemExit(main())
