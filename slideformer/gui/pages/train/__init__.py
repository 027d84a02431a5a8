"""The app's train."""
