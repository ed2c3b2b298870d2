"""Why a restore was refused (kmesh.restore and the CUDA launcher raise the same types); the destination is
then unchanged."""
from __future__ import annotations

from kmesh.errors import KMeshError


class RestoreError(KMeshError):
    """A restore was refused; the destination is unchanged."""


class SegmentError(RestoreError):
    """A segment is malformed or does not match the destination layout."""


class HeadCountError(SegmentError):
    """The segment's kv-head count differs from the layout's."""


class HeadDimError(SegmentError):
    """The segment's K/V width (or the rope's) differs from the layout's."""


class DtypeMismatchError(SegmentError):
    """The segment's dtype differs from the cache's."""


class ScaleMismatchError(SegmentError):
    """fp8 segment scales differ from the cache's: values could not be copied byte for byte."""


class LayerRangeError(RestoreError):
    """The segment's layers do not fit in the cache's layers from first_layer on."""


class SlotError(RestoreError):
    """Destination slots are malformed."""


class SlotRangeError(SlotError):
    """A destination slot is below −1 or beyond the cache."""


class DuplicateSlotError(SlotError):
    """Two tokens target the same destination slot."""


class PositionError(RestoreError):
    """Key positions (capture's positions, restore's new_positions) are malformed: not 1-D integers."""


class DestinationError(RestoreError):
    """The destination buffer cannot hold this layout."""


class NonContiguousDestinationError(DestinationError):
    """The destination is not one contiguous 1-D byte buffer."""


class MisalignedDestinationError(DestinationError):
    """The destination's address or the layout's offsets are not element-aligned."""


class DeviceMismatchError(RestoreError):
    """Segment and cache live on different devices."""
