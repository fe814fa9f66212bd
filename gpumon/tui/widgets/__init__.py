"""Widgets: they render what the model hands them."""
