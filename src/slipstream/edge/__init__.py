"""Edge bundles: a model as a self-contained directory for a device (``slipstream export``).

``export.export_bundle`` makes the target's model (``targets``: INT8 ONNX, ONNX
Runtime's ``.ort`` format, OpenVINO IR), judges it with optimize's accuracy gate, and
writes it with its config, sample rows and a ``manifest`` of every file's SHA-256;
``manifest.verify_bundle`` checks a bundle against it. A bundle directory is a model
repository entry as it is. Fleet updates on TUF: ``fleet_repo`` signs bundles into a
repository of static files (``slipstream fleet``), ``fleet_server`` serves it and takes
device reports, ``fleet_client`` and ``agent`` keep a device at the newest signed bundle,
and ``device`` runs both as ``slipstream edge``. Nothing is imported here: the
``slipstream`` CLI loads ``edge.cli`` and ``edge.fleet_cli`` (click only) at start-up,
the rest when a command runs.
"""
