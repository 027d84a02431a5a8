"""SlideFormer Studio: the ``slideformer`` command, composed of the engine's commands and the
desktop app's (:mod:`slideformer.cli`)."""
