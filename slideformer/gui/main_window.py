"""The main window: a sidebar of pages, the Monitor dock, menus, and remembered layout.

Pages are listed once, in :data:`PAGES`. A page is a QWidget built as ``Page(ctx)`` from the
shared :class:`AppContext`; pages talk to each other only through the context (for example the
Model page calls ``ctx.set_model`` and a Plan page listens to ``ctx.model_changed``). Adding a
page is adding one line to :data:`PAGES`.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QApplication, QDockWidget, QFrame, QHBoxLayout, QLabel,
                               QListWidget, QListWidgetItem, QMainWindow, QScrollArea,
                               QStackedWidget, QToolButton, QWidget)

from slideformer.gui.pages.about import AboutDialog
from slideformer.gui.pages.chat.page import ChatPage
from slideformer.gui.context import AppContext
from slideformer.gui.pages.data import DataPage
from slideformer.gui.models.formatting import short_path
from slideformer.gui.pages.model import ModelPage
from slideformer.gui.widgets.dock import CollapsibleDock
from slideformer.gui.widgets.monitor import MonitorPanel
from slideformer.gui.workers.sampler import MonitorSampler
from slideformer.gui.pages.plan.page import PlanPage
from slideformer.gui.pages.runs import RunsPage
from slideformer.gui.theme import PLOT_COLORS, icon, palette, style_sheet
from slideformer.gui.pages.train.page import TrainPage

SIDEBAR_PX = 124
DOCK_MIN_PX, DOCK_PX = 240, 280
"""The Monitor dock's least and first width: with the sidebar, they leave a 1366 px screen
about 900 px for the page (the widest page, Data, needs 800)."""
DEFAULT_SIZE = (1366, 768)
"""A laptop's screen: the size every page is laid out and tested for."""

# The sidebar, top to bottom: (title, icon in slideformer/gui/resources/icons, page class built as Page(ctx)).
PAGES = (
    ("Model", "model.svg", ModelPage),
    ("Data", "data.svg", DataPage),
    ("Plan", "plan.svg", PlanPage),
    ("Train", "train.svg", TrainPage),
    ("Runs", "runs.svg", RunsPage),
    ("Chat", "chat.svg", ChatPage),
)


class MainWindow(QMainWindow):
    """Sidebar + page stack in the centre, the Monitor as a dock (right by default)."""

    def __init__(self, ctx: AppContext):
        super().__init__()
        self.ctx = ctx
        self.setWindowTitle("SlideFormer Studio")
        self.setWindowIcon(icon("slideformer.svg"))

        self._build_pages()
        self._build_monitor()
        self._build_status_bar()
        ctx.model_changed.connect(self._show_model)
        ctx.run_requested.connect(lambda *_: self.show_page("Train"))
        ctx.plan_used.connect(lambda *_: self.show_page("Train"))
        self.model_page.plan_requested.connect(lambda: self.show_page("Plan"))
        self._build_menus()
        self.set_theme(ctx.settings.theme())
        self._restore_layout()

    def _build_pages(self) -> None:
        """The sidebar and the stack of pages it switches between, in :data:`PAGES` order."""
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.sidebar.setFixedWidth(SIDEBAR_PX)
        self.sidebar.setIconSize(QSize(20, 20))
        self.stack = QStackedWidget()
        self.pages: dict[str, QWidget] = {}
        for title, icon_file, page_class in PAGES:
            page = page_class(self.ctx)
            self.pages[title] = page
            self.stack.addWidget(page)
            self.sidebar.addItem(QListWidgetItem(icon(icon_file), title))
        self.sidebar.currentRowChanged.connect(self.stack.setCurrentIndex)
        self.sidebar.setCurrentRow(0)
        central = QWidget()
        lay = QHBoxLayout(central)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(self.sidebar)
        self.stack.setContentsMargins(10, 8, 10, 8)
        lay.addWidget(self.stack, 1)
        self.setCentralWidget(central)

    def _build_monitor(self) -> None:
        """The Monitor's charts in a collapsible dock, fed by a sampler thread."""
        self.monitor = MonitorPanel()
        scroll = QScrollArea()  # the dock can be shorter than seven charts
        scroll.setWidget(self.monitor)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.monitor_dock = CollapsibleDock("Monitor", scroll, DOCK_PX, DOCK_MIN_PX, self)
        self.monitor_dock.setObjectName("monitorDock")  # saveState() keys docks by name
        self.monitor_dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetClosable
                                      | QDockWidget.DockWidgetFeature.DockWidgetMovable
                                      | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.monitor_dock)
        self.resizeDocks([self.monitor_dock], [DOCK_PX], Qt.Orientation.Horizontal)
        self.sampler = MonitorSampler(self.ctx.gpu_source, parent=self)
        self.sampler.sampled.connect(self.monitor.add_sample)
        self.sampler.gpu_found.connect(self.monitor.show_gpu)
        self.sampler.gpu_missing.connect(self.monitor.show_no_gpu)

    def _build_status_bar(self) -> None:
        self.model_label = QLabel("No model chosen")
        self.statusBar().addWidget(self.model_label)
        monitor_button = QToolButton()
        monitor_button.setDefaultAction(self.monitor_dock.toggleViewAction())
        monitor_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.statusBar().addPermanentWidget(monitor_button)  # show or hide the Monitor (Ctrl+M)

    def _restore_layout(self) -> None:
        """The size, dock and theme of the last session (a laptop's screen the first time)."""
        self.resize(*DEFAULT_SIZE)
        settings = self.ctx.settings
        geometry, state = settings.window_geometry(), settings.window_state()
        if geometry is not None:
            self.restoreGeometry(geometry)
        if state is not None:
            self.restoreState(state)
        self.monitor_dock.collapse_action.setChecked(settings.monitor_collapsed())

    def _show_model(self, path: str) -> None:
        """The folder's name (a long path would set the window's least width)."""
        self.model_label.setText(f"Model: {Path(path).name}")
        self.model_label.setToolTip(short_path(path))

    @property
    def model_page(self) -> ModelPage:
        return self.pages["Model"]

    def show_page(self, title: str) -> None:
        self.sidebar.setCurrentRow(list(self.pages).index(title))

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        choose = file_menu.addAction("Choose model folder…")
        choose.setShortcut(QKeySequence.StandardKey.Open)
        choose.triggered.connect(lambda: (self.show_page("Model"), self.model_page.choose_folder()))
        file_menu.addSeparator()
        quit_action = file_menu.addAction("Quit")
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)

        view = self.menuBar().addMenu("&View")
        toggle = self.monitor_dock.toggleViewAction()
        toggle.setText("Monitor")
        toggle.setIcon(icon("monitor.svg"))
        toggle.setShortcut(QKeySequence("Ctrl+M"))
        view.addAction(toggle)
        collapse = self.monitor_dock.collapse_action
        collapse.setText("Collapse the Monitor to a strip")
        collapse.setShortcut(QKeySequence("Ctrl+Shift+M"))
        view.addAction(collapse)
        self.dark_action = QAction("Dark theme", self, checkable=True)
        self.dark_action.toggled.connect(lambda on: self.set_theme("dark" if on else "light"))
        view.addAction(self.dark_action)

        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction("About SlideFormer Studio").triggered.connect(self.show_about)

    def set_theme(self, name: str) -> None:
        """Switch to the "light" or "dark" style sheet and plot colours, and remember it."""
        app = QApplication.instance()
        app.setPalette(palette(name, app.style().standardPalette()))
        app.setStyleSheet(style_sheet(name))
        self.monitor.set_colors(*PLOT_COLORS[name])
        self.ctx.theme_changed.emit(name)
        self.dark_action.blockSignals(True)
        self.dark_action.setChecked(name == "dark")
        self.dark_action.blockSignals(False)
        self.ctx.settings.set_theme(name)

    def show_about(self) -> AboutDialog:
        dialog = AboutDialog(self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.open()
        return dialog

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.sampler.start()

    def closeEvent(self, event) -> None:
        # A page with work in progress (a training run) may ask the user, or refuse.
        for page in self.pages.values():
            confirm = getattr(page, "confirm_close", None)
            if confirm is not None and not confirm():
                event.ignore()
                return
        self.sampler.stop()
        self.ctx.settings.save_window(self.saveGeometry(), self.saveState())
        self.ctx.settings.set_monitor_collapsed(self.monitor_dock.collapsed)
        self.ctx.settings.sync()
        super().closeEvent(event)
