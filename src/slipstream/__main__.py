"""``python -m slipstream``: the ``slipstream`` command, where its script is not installed."""

from slipstream.cli import main

if __name__ == "__main__":
    main()
