// Command pepsi-queue shows and steers the messages of a pepsi-dispatch system: counts per
// stage and status, ages, failures grouped by cause, and the operator's actions (retry, hold,
// release, cancel, delete, pause and resume a stage). Every action is a SQL function of
// operate.sql; this program parses the command line, selects ids, calls the functions in
// batches and prints their answers. See pepsi-queue(1).
//
// Exit status: 0 when every named row was acted on (or the query ran); 1 when the database
// answered but some rows were refused (each on standard error with its reason) or refused a
// statement; 2 for a usage or configuration error; 3 when the database could not be reached.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
