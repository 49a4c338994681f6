"""Edge bundles: a model as a self-contained directory for a device (``slipstream export``).

``export.export_bundle`` makes the target's model (``targets``: INT8 ONNX, ONNX
Runtime's ``.ort`` format, OpenVINO IR), judges it with optimize's accuracy gate, and
writes it with its config, sample rows and a ``manifest`` of every file's SHA-256;
``manifest.verify_bundle`` checks a bundle against it. A bundle directory is a model
repository entry as it is.
"""

from slipstream.edge.export import ExportRequest, ExportResult, check_samples, export_bundle
from slipstream.edge.manifest import BundleError, Manifest, read_manifest, verify_bundle
from slipstream.edge.targets import TARGETS, ExportError, Target, TargetOptions

__all__ = [
    "TARGETS",
    "BundleError",
    "ExportError",
    "ExportRequest",
    "ExportResult",
    "Manifest",
    "Target",
    "TargetOptions",
    "check_samples",
    "export_bundle",
    "read_manifest",
    "verify_bundle",
]
