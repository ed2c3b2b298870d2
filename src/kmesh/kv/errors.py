"""Every refusal of the kv package: why a restore was refused (kmesh.kv.restore and the CUDA launcher raise the
same types; the destination is then unchanged), and why a saved segment could not be brought back (a
SegmentLoadError: the caller recomputes instead, never reuses part of it)."""
from __future__ import annotations

from typing import Any

from kmesh.errors import KMeshError
from kmesh.transfer.errors import TransferError


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


class SegmentLoadError(KMeshError):
    """A shared segment could not be brought back intact; the child must recompute instead."""


class SegmentMissingError(SegmentLoadError):
    """The object is not in the store (never saved, or evicted)."""


class SegmentCorruptError(SegmentLoadError):
    """The loaded bytes do not have the digest the leader recorded."""


class SegmentExportError(KMeshError):
    """A workload's segments cannot be exported (a segment of no tokens)."""


class SegmentCatalogError(SegmentLoadError):
    """A catalog entry disagrees with its layout: not the whole blocks its tokens span, from a block start."""


class SegmentSizeError(SegmentLoadError):
    """The object's size is not the catalog entry's (what its tokens need under the layout)."""


class SegmentTruncatedError(SegmentSizeError):
    """The object holds fewer bytes than the catalog entry says it must."""


class SegmentOversizeError(SegmentSizeError):
    """The object holds more bytes than the catalog entry says it must."""


class SegmentLayoutError(SegmentLoadError):
    """The object was saved under another KV geometry than the child's staging buffer."""


class SegmentSourceLostError(SegmentLoadError):
    """The source (the cache service) went away during the load."""


class SegmentCancelledError(SegmentLoadError):
    """The load was cancelled before it completed."""


class PrivateCopyError(TransferError):
    """A private copy failed at one segment; `copied` are the segments before it, drained and whole."""

    def __init__(self, message: str, copied: list[Any]) -> None:
        super().__init__(message)
        self.copied = copied


class LinkUnavailable(SegmentSourceLostError):
    """The cache service cannot be reached (or went away): the caller computes instead (kmesh.kv.link)."""


class SegmentSaveError(KMeshError):
    """A save into the cache service did not complete (failed or cancelled)."""
