"""The Textual UI of gpumon (imports model/, never agent/)."""
