"""What the terminal app costs the engine: the app in tmux against the engine alone, the UI thread's CPU."""
