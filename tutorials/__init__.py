"""The tutorials' shared code: `tutorials.notebook_setup` (run first by every notebook) and `tutorials.plotting`."""
