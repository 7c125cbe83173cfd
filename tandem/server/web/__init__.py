"""The server's own pages: a chat at `/`, the engines' live view at `/dashboard` (static files
shipped in the package, no build step) and the dashboard's data."""
