"""SlideFormer Studio's desktop app (PySide6 + pyqtgraph).

It talks to the engine only through its commands and events, and never blocks its GUI thread:
slow work runs on worker threads (:mod:`slideformer.gui.workers.thread`) and reports back by signal.
"""
