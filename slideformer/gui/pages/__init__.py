"""The app's pages."""
