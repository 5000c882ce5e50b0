"""The torch.fx passes, and the runtime helpers their generated code calls (runtime.py)."""
