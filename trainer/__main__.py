"""`python -m trainer`: one training worker."""

from trainer.train import main

if __name__ == "__main__":
    raise SystemExit(main())
