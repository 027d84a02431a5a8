"""The app's workers."""
