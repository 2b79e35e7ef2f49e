"""`omlx menubar`: a macOS menu-bar client of the admin API (presenter.py holds its logic;
app.py is the thin rumps layer, macOS only)."""
