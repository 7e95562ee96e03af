"""What routing reads besides load: signature messages (board, intake over HTTP and TCP, encoder), engine batch reports, predicted signatures and early binding."""
