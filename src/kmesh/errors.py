"""Exception roots. Each module defines its specific errors as subclasses of these."""


class KMeshError(Exception):
    """Base of every error KMesh raises on purpose."""


class ConfigError(KMeshError):
    """The configuration is invalid; the message names the offending field."""


class ResultError(KMeshError):
    """A result file is missing, malformed or of another schema."""


class StageError(KMeshError):
    """A pipeline stage could not run at all (as opposed to running with failed cases)."""
