"""In-place conversion: convert(model, inplace=True) keeps the user's model object (conversion.py)."""
from amp_compiler.in_place.conversion import convert_in_place, in_place_conversion, restore
from amp_compiler.in_place.part import CAPTURE_LIMIT, CaptureLimitWarning

__all__ = ["convert_in_place", "in_place_conversion", "restore", "CAPTURE_LIMIT", "CaptureLimitWarning"]
