"""The app's plan."""
