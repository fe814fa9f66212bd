"""Pure data for the views: no Textual, no torch."""
