"""The app's widgets."""
