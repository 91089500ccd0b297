// instance.go: exactly one dispatcher per system, enforced by the database.
//
// A system is one workqueue table (one schema). Its key is the table's oid, so two systems in
// one database never collide. The dispatcher holds a session advisory lock on the key on a
// dedicated connection, and runs its claims and its own row writes on that same connection:
// a write can only commit while the lock is held, so "one claimer" is a fact, not a hope.
//
// Start-up fences off a previous dispatcher before touching its rows: its sessions and its
// workers' sessions (found by application_name) are terminated and waited for, so no worker
// of an earlier run can commit a message that the orphan reset hands out again. The workers
// themselves die with their dispatcher (parent-death signal, worker.go).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/schemafile"
)

// lockClass is the first half of the advisory lock key: "peps" in ASCII, so the lock is
// recognisable in pg_locks (classid) next to other applications' locks.
const lockClass = 0x70657073

// fenceTimeout bounds the wait for a previous run's sessions to go away.
const fenceTimeout = 30 * time.Second

// errLockHeld means another dispatcher holds the lock for this system.
var errLockHeld = errors.New("another pepsi-dispatch is running for this system")

// errLockLost means the lock connection was lost and the lock could not be proven ours again.
var errLockLost = errors.New("single-instance lock lost")

// instance is the lock connection and what the lock protects.
type instance struct {
	db    *sql.DB   // the pool the lock connection comes from
	conn  *sql.Conn // holds the advisory lock; runs the coordinator's claims and writes
	key   int32     // second half of the advisory lock key: the workqueue table's oid
	epoch int64     // our start's number in dispatch_instance

	server    dbServer      // the server the lock session is on: its address (the log, /metrics), its run
	keepalive time.Duration // LOCK_KEEPALIVE, applied to every lock session
}

// newerSchemaSaid: a schema newer than this program is said once per run, not at each of
// the connects of a start and of every relock.
var newerSchemaSaid atomic.Bool

// systemKey returns the lock key of the workqueue table in the connection's search_path.
// It also checks that the schema is there and not older than this program
// (schemafile.CheckVersion), and says how to apply it if not.
func systemKey(ctx context.Context, log *slog.Logger, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) (int32, error) {
	var missing []string
	var oid sql.NullInt64
	err := q.QueryRowContext(ctx, `
		SELECT to_regclass('workqueue')::oid::bigint,
		       array_remove(ARRAY[
		         CASE WHEN to_regclass('workqueue') IS NULL THEN 'workqueue' END,
		         CASE WHEN to_regclass('config') IS NULL THEN 'config' END,
		         CASE WHEN to_regclass('stage_stats') IS NULL THEN 'stage_stats' END,
		         CASE WHEN to_regclass('dispatch_stats') IS NULL THEN 'dispatch_stats' END,
		         CASE WHEN to_regclass('dispatch_instance') IS NULL THEN 'dispatch_instance' END,
		         CASE WHEN to_regclass('workqueue_claim_seq') IS NULL THEN 'workqueue_claim_seq' END
		       ], NULL)::text[]`).Scan(&oid, pq.Array(&missing))
	if err != nil {
		return 0, fmt.Errorf("check schema: %w", err)
	}
	if len(missing) > 0 {
		return 0, fmt.Errorf("check schema: %v not found in the search_path of this connection; "+
			"apply the schema first: %s", missing, schemafile.Apply)
	}
	have, err := schemafile.CheckVersion(ctx, q)
	if err != nil {
		return 0, err
	}
	if have > schemafile.Version && newerSchemaSaid.CompareAndSwap(false, true) {
		log.Warn("the schema in the database is newer than this program (a newer version applied it): "+
			"running, but what this version does not know of it may refuse its writes; run the version that applied it",
			"schema_version", have, "program_schema_version", schemafile.Version)
	}
	// oids are unsigned 32-bit; fold them into the signed half of the two-key lock.
	return int32(uint32(oid.Int64)), nil
}

// acquire opens the lock connection and takes the lock, on a writable server only. Without
// STANDBY it does not wait: a second dispatcher must refuse to start, not queue behind the
// first. With it, it waits for the holder's session to end (standby.go).
func acquire(ctx context.Context, db *sql.DB, dc DispatchConfig, log *slog.Logger, sigs <-chan os.Signal, ha *haBoard) (*instance, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	key, err := systemKey(ctx, log, conn)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if err := lockKeepalive(ctx, conn, dc.LockKeepalive); err != nil {
		conn.Close()
		return nil, err
	}
	got, server, err := takeLock(ctx, conn, key, false)
	if err != nil {
		conn.Close()
		return nil, err
	}
	tookOver := false
	if !got {
		holder := describeHolder(ctx, conn)
		if !dc.Standby {
			conn.Close()
			return nil, fmt.Errorf("%w (%s); refusing to start a second one", errLockHeld, holder)
		}
		ha.update(func(s *haStatus) { s.role, s.server, s.waitedFor = "standby", server.addr, holder })
		log.Info("standby: another dispatcher holds the single-instance lock; waiting for it", "holder", holder, "server", server.addr)
		start := time.Now()
		if server, err = waitForLock(ctx, conn, key, sigs); err != nil {
			conn.Close()
			return nil, err
		}
		log.Info("standby: took over the single-instance lock", "previous", holder, "server", server.addr,
			"waited", time.Since(start).Round(time.Millisecond))
		tookOver = true
	} else if st := ha.load(); st != nil && st.waitedFor != "" {
		// A standby whose wait was cut (its session lost with the server's machine, a
		// failover) and that finds the lock free at its next attempt: the holder's session
		// ended meanwhile, and this is the takeover, though no wait returned it. It was
		// logged and counted as a plain start (TestFailoverPrimaryVanishes, beside a standby).
		log.Info("standby: took over the single-instance lock", "previous", st.waitedFor, "server", server.addr,
			"how", "free at a new attempt after the wait was cut")
		tookOver = true
	}
	ha.update(func(s *haStatus) {
		s.role, s.server, s.waitedFor = "active", server.addr, ""
		if tookOver {
			s.takeovers++
		}
	})
	return &instance{db: db, conn: conn, key: key, server: server, keepalive: dc.LockKeepalive}, nil
}

// describeHolder says who holds the lock, for the refusal message.
func describeHolder(ctx context.Context, conn *sql.Conn) string {
	var pid sql.NullInt64
	var host, since sql.NullString
	err := conn.QueryRowContext(ctx, `SELECT pid, host, to_char(started_at, 'YYYY-MM-DD HH24:MI:SS TZ')
		FROM dispatch_instance WHERE id = 1`).Scan(&pid, &host, &since)
	if err != nil || !pid.Valid {
		return "holder unknown"
	}
	return fmt.Sprintf("pid %d on %s, started %s", pid.Int64, host.String, since.String)
}

// appName returns the application_name of a session kind of this system.
func (in *instance) appName(kind string) string { return fmt.Sprintf("%s %d", kind, in.key) }

// workerAppName is the application_name of this run's workers: the system and our epoch, by
// which schema.sql's pepsi_fence refuses the workers of a dispatcher that was replaced.
func (in *instance) workerAppName() string {
	return fmt.Sprintf("%s %d %d", appWorker, in.key, in.epoch)
}

// dispatchAppName names the sessions of this run's work pool (statistics, retention, the
// fan-in flush): fenced like the workers, so a replaced dispatcher that comes back cannot
// write through its pool either. The lock connection keeps appName(appDispatch): it is opened
// before the epoch is known, and the lock itself fences it.
func (in *instance) dispatchAppName() string {
	return fmt.Sprintf("%s %d %d", appDispatch, in.key, in.epoch)
}

// fence records our start, then terminates the sessions a previous dispatcher and its
// workers left behind and waits until they are gone. The new epoch comes first: from its
// commit on, a worker of an earlier run that reconnects (a frozen machine thawed) cannot write
// workqueue (schema.sql's pepsi_fence), and one still connected is terminated here. After
// it returns, no earlier run can commit.
func (in *instance) fence(ctx context.Context, version string) (int, error) {
	host, _ := os.Hostname()
	err := in.conn.QueryRowContext(ctx, `
		UPDATE dispatch_instance SET epoch = epoch + 1, pid = $1, host = $2, version = $3, started_at = now()
		 WHERE id = 1 RETURNING epoch`, os.Getpid(), host, version).Scan(&in.epoch)
	if err != nil {
		return 0, fmt.Errorf("record start in dispatch_instance: %w", err)
	}
	names := []string{in.appName(appDispatch), in.appName(appWorker)}
	// This system's workers and work pools of any epoch.
	epochs := []string{in.appName(appWorker) + " %", in.appName(appDispatch) + " %"}
	var killed int
	err = in.conn.QueryRowContext(ctx, `
		SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		 WHERE datname = current_database() AND (application_name = ANY($1) OR application_name LIKE ANY($2))
		   AND pid <> pg_backend_pid()`, pq.Array(names), pq.Array(epochs)).Scan(&killed)
	if err != nil {
		return 0, fmt.Errorf("fence previous sessions: %w", err)
	}
	deadline := time.Now().Add(fenceTimeout)
	for delay := 5 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		var left int
		err := in.conn.QueryRowContext(ctx, `
			SELECT count(*) FROM pg_stat_activity
			 WHERE datname = current_database() AND (application_name = ANY($1) OR application_name LIKE ANY($2))
			   AND pid <> pg_backend_pid()`, pq.Array(names), pq.Array(epochs)).Scan(&left)
		if err != nil {
			return 0, fmt.Errorf("fence previous sessions: %w", err)
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("fence previous sessions: %d sessions of an earlier run are still there after %v", left, fenceTimeout)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(delay):
		}
	}
	return killed, nil
}

// resetOrphans puts back to pending every row left running by an earlier run. Only safe after
// fence: then nobody else can be working on them. It goes through resetSQL, which passes over
// a row another transaction holds (an operator's or an application's, left open: fence ended
// the earlier run's own sessions) instead of waiting for it with no budget before the first
// claim; those are in held, for the coordinator to reset once let go (writeOutcomes). So are
// the rows whose reset the database refused by itself (refused: an application's trigger),
// which used to stop the start, and the next (resetRows).
func (in *instance) resetOrphans(ctx context.Context) (orphans []*message, written int64, held map[int64]bool,
	refused map[int64]error, err error) {
	if orphans, err = readRunning(ctx, in.conn); err != nil {
		return nil, 0, nil, nil, fmt.Errorf("reset orphaned running rows: %w", err)
	}
	if len(orphans) == 0 {
		return nil, 0, nil, nil, nil
	}
	if written, held, refused, err = resetRows(ctx, in.conn, orphans, time.Time{}); err != nil {
		return nil, 0, nil, nil, fmt.Errorf("reset orphaned running rows: %w", err)
	}
	return orphans, written, held, refused, nil
}

// relock replaces a lost lock connection. It succeeds only if the lock is free and no other
// dispatcher started meanwhile (the epoch is still ours); otherwise the caller must exit.
// moved says the lock is now on another server than before, or on the same after a restart:
// no session opened before the loss can be open on it.
func (in *instance) relock(ctx context.Context) (moved bool, err error) {
	if in.conn != nil {
		// Broken, or alive on a server that went read-only: either way its session must end
		// (and with it any lock it still holds there), not go back to the pool.
		discard(in.conn)
		in.conn = nil
	}
	conn, err := in.db.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("reconnect: %w", err)
	}
	if err := lockKeepalive(ctx, conn, in.keepalive); err != nil {
		conn.Close()
		return false, err
	}
	got, server, err := takeLock(ctx, conn, in.key, false)
	if err != nil {
		conn.Close()
		return false, fmt.Errorf("take single-instance lock again: %w", err)
	}
	if !got {
		conn.Close()
		return false, fmt.Errorf("%w: another dispatcher holds it now", errLockLost)
	}
	var epoch int64
	if err := conn.QueryRowContext(ctx, `SELECT epoch FROM dispatch_instance WHERE id = 1`).Scan(&epoch); err != nil {
		conn.Close()
		return false, fmt.Errorf("read epoch: %w", err)
	}
	if epoch != in.epoch {
		conn.Close()
		return false, fmt.Errorf("%w: another dispatcher ran while it was lost (epoch %d, ours %d)", errLockLost, epoch, in.epoch)
	}
	moved = !server.same(in.server)
	in.conn, in.server = conn, server
	return moved, nil
}

func (in *instance) close() {
	if in.conn != nil {
		discard(in.conn) // ending the session releases the advisory lock
		in.conn = nil
	}
}
