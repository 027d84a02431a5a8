"""The app's models."""
