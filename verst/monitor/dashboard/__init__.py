"""`verst dashboard`: a live web page of run directories (`server`), fed by what it reads of
them (`data`); the page itself is package data under `static/` (uPlot 1.6.32, MIT, vendored)."""
