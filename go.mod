module pepsi-dispatch

go 1.23

require github.com/lib/pq v1.12.3
