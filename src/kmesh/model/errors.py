from kmesh.errors import KMeshError


class ModelError(KMeshError):
    """A model cannot be located, converted or loaded; the message says which file or setting and why."""
