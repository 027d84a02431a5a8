"""The app's chat."""
