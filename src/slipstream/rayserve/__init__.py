"""The repository as Ray Serve applications (``slipstream serve --ray``); see :mod:`.app`."""
