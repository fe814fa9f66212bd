"""Textual screens of `gpumon view FILE`."""
