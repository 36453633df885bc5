"""Pull consumption: consumer groups over an app's group log, receipts, long polls."""
