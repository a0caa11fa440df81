"""``python -m pipeline.audit [overrides]``: the empirical privacy audit (``pipeline.audit.command``)."""

from pipeline.audit.command import cli

if __name__ == "__main__":
    cli()
