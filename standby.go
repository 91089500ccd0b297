// standby.go: getting to the point where this dispatcher holds the single-instance lock on a
// writable server: waiting for the database, for a primary, and, as a standby dispatcher
// (STANDBY = yes), for the holder's session to end.
//
// It runs before the coordinator exists, on serve's goroutine, and owns nothing after it
// returns but the instance it built. A standby waits in the server (a blocking
// pg_advisory_lock on a primary), so the takeover begins the moment the holder's session
// ends: at once when its process dies, within LOCK_KEEPALIVE when its machine vanishes. The
// takeover itself (fence the old workers, reset their rows) is instance.go's start-up path.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"pepsi-dispatch/internal/pgsession"
)

// errStopped means a signal arrived while waiting: a clean exit, not an error.
var errStopped = errors.New("stopped by a signal while waiting")

// dsnOwn is the DSN of the dispatcher's own sessions: it needs a server that accepts writes,
// so lib/pq walks the host list to one (target_session_attrs=read-write). The workers get the
// [database] DSN unchanged.
func dsnOwn(dsn string) string { return dsnWith(dsn, "target_session_attrs", "read-write") }

// connect opens the pool and takes the single-instance lock. A database that is not up, or
// whose servers are all read-only (standbys, a primary set read-only), is waited for, with a
// line that says which and names the servers; another dispatcher holding the lock is fatal
// (exit 1), or waited for with STANDBY = yes. It returns a nil instance and no error when a
// signal ended the wait.
func connect(ctx context.Context, cfg *Config, log *slog.Logger, sigs <-chan os.Signal, ha *haBoard) (*instance, *sql.DB, error) {
	b := backoff{min: 200 * time.Millisecond, max: 5 * time.Second}
	var lastWhy string
	for attempt := 1; ; attempt++ {
		inst, db, err := tryConnect(ctx, cfg, log, sigs, ha)
		if err == nil {
			return inst, db, nil
		}
		if errors.Is(err, errStopped) {
			log.Info("shutting down while waiting for the single-instance lock")
			return nil, nil, nil
		}
		var why string
		switch {
		case cutWaiting(err):
			// A standby's wait cut by statement_timeout or lock_timeout (the DSN's options):
			// not a failure, just wait again.
			why = "standby: the wait for the lock was cut by a timeout; waiting again"
		case errors.Is(err, errReadOnly) || isReadOnlyErr(err):
			why = "no writable database server yet; waiting for one"
		case isConnLost(err):
			why = "database not reachable; waiting for it"
		default:
			return nil, nil, connectError(err)
		}
		if !cutWaiting(err) {
			ha.update(func(s *haStatus) { s.role = "waiting" })
		}
		d := b.next()
		if why != lastWhy || attempt%10 == 0 {
			log.Warn(why, "err", err, "attempt", attempt, "retry_in", d.Round(time.Millisecond))
			lastWhy = why
		}
		select {
		case s := <-sigs:
			log.Info("shutting down while waiting for the database", "signal", s.String())
			return nil, nil, nil
		case <-time.After(d):
		}
	}
}

func tryConnect(ctx context.Context, cfg *Config, log *slog.Logger, sigs <-chan os.Signal, ha *haBoard) (*instance, *sql.DB, error) {
	own := dsnOwn(cfg.DSN)
	// The system key (the workqueue table's oid) names our sessions; learn it first.
	boot, err := pgsession.Open(dsnWith(own, "application_name", appDispatch), cfg.Dispatch.LockKeepalive)
	if err != nil {
		return nil, nil, fmt.Errorf("open database: %w", err)
	}
	key, err := systemKey(ctx, log, boot)
	boot.Close()
	if err != nil {
		return nil, nil, err
	}
	db, err := pgsession.Open(dsnWith(own, "application_name", fmt.Sprintf("%s %d", appDispatch, key)), cfg.Dispatch.LockKeepalive)
	if err != nil {
		return nil, nil, fmt.Errorf("open database: %w", err)
	}
	// The lock connection's own pool: one session, replaced when it breaks (relock). The
	// coordinator's other statements get a pool named with the epoch (openWorkPool).
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	inst, err := acquire(ctx, db, cfg.Dispatch, log, sigs, ha)
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	return inst, db, nil
}

// waitForLock blocks in the server until the lock is ours (the holder's session ended), or a
// signal arrives (errStopped), or the connection fails (the caller starts over).
func waitForLock(ctx context.Context, conn *sql.Conn, key int32, sigs <-chan os.Signal) (server dbServer, err error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	quit := make(chan struct{})
	var stopped os.Signal
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case stopped = <-sigs:
			cancel() // lib/pq sends the server a cancel request: the lock wait ends
		case <-quit:
		}
	}()
	got, server, err := takeLock(wctx, conn, key, true)
	close(quit)
	wg.Wait()
	if stopped != nil {
		return dbServer{}, fmt.Errorf("%w (%s)", errStopped, stopped)
	}
	if err != nil {
		return server, err
	}
	if !got {
		return server, fmt.Errorf("wait for the single-instance lock: not granted")
	}
	return server, nil
}
