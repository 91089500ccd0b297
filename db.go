// db.go: how the dispatcher talks to PostgreSQL: connection names, error classes and the
// retry helper every queue operation goes through.
//
// It owns no state. Connections are named (application_name) so that the schema's requeue
// trigger stays quiet for pepsi's own writes and so that a new dispatcher can find, and fence
// off, the sessions of a previous one and of its workers (instance.go).

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/lib/pq"
)

// Application names. The suffix is the system key (instance.go), so that several systems on
// one database never fence each other's sessions.
const (
	appDispatch = "pepsi-dispatch"
	appWorker   = "pepsi-worker"
)

// dsnWith returns dsn with the connection parameter key set to value, for both DSN forms
// (URL and key=value). A later key=value wins in libpq and lib/pq alike, so appending is enough.
func dsnWith(dsn, key, value string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err == nil {
			q := u.Query()
			q.Set(key, value)
			// Encode writes a space as '+', which libpq (psql, psycopg) does not decode: a
			// non-Go worker would read "+search_path". Literal '+' is already %2B, so every
			// remaining '+' is a space.
			u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
			return u.String()
		}
	}
	quoted := strings.ReplaceAll(strings.ReplaceAll(value, `\`, `\\`), `'`, `\'`)
	if strings.TrimSpace(dsn) == "" {
		return fmt.Sprintf("%s='%s'", key, quoted)
	}
	return fmt.Sprintf("%s %s='%s'", dsn, key, quoted)
}

// withSSLModeDefault returns dsn with sslmode=prefer added when neither the DSN nor the
// environment chooses an sslmode, so that the dispatcher (lib/pq, whose own default is
// "require") connects as libpq does with the same DSN: TLS when the server offers it, plain
// otherwise. The workers get the same DSN, so a libpq stage (psql, psycopg) and a Go stage
// agree too. (lib/pq accepts "prefer" since v1.12.0; pepsi.conf(5) says so.) sslrootcert=system
// and sslnegotiation=direct imply stronger modes, so they are left to choose.
func withSSLModeDefault(dsn string) string {
	if dsn == "" {
		return dsn
	}
	cfg, err := pq.NewConfig(dsn)
	if err != nil || cfg.SSLMode != "" || cfg.SSLRootCert == "system" || cfg.SSLNegotiation != "" {
		return dsn // an error was reported by dsnsecret.Check; a Unix socket has SSLMode "disable"
	}
	return dsnWith(dsn, "sslmode", "prefer")
}

// connectError explains a connection failure that no retry can cure because it is about a
// local file, typically a client certificate, key or password file the account cannot read
// after the privilege drop: the operator must fix the file or the DSN.
func connectError(err error) error {
	var pe *fs.PathError
	if !errors.As(err, &pe) {
		return err
	}
	who := fmt.Sprintf("uid %d", os.Getuid())
	if name := os.Getenv("USER"); name != "" {
		who = fmt.Sprintf("%s (%s)", name, who)
	}
	return fmt.Errorf("connect to the database: %w; the driver reads %s as %s (HOME=%s): "+
		"make it readable by that account, or name other files with the DSN's sslcert, sslkey, "+
		"sslrootcert or passfile", err, pe.Path, who, os.Getenv("HOME"))
}

// isTransient reports whether err is a serialization failure or a deadlock: the statement
// did nothing and may simply be run again.
func isTransient(err error) bool {
	var pe *pq.Error
	if errors.As(err, &pe) {
		return pe.Code == "40001" || pe.Code == "40P01"
	}
	return false
}

// cutWaiting reports whether the server cut a statement short for waiting too long by a
// setting of the role's, the database's or the DSN's: lock_timeout (55P03) or
// statement_timeout (57014; also a cancel of our own: callers tell it by their context). The
// claim takes it for its budget running out, sooner (claim.go: a role with lock_timeout =
// 100ms made it fail at every held pending row, taken for the database refusing the stage's
// claim, so it never passed over the row: TestClaimPastRoleLockTimeout); a standby waiting
// for the lock waits again (standby.go); a walk of the table halves its window (halvedOnCut).
func cutWaiting(err error) bool {
	var pe *pq.Error
	return errors.As(err, &pe) && (pe.Code == "55P03" || pe.Code == "57014")
}

// halvedOnCut is the next window of a walk of the table a window per statement (the start's
// and the reconcile's read of running rows, retention's delete) when err is the server
// cutting its statement (cutWaiting) and not our own context (ours): half the window, down to
// floor. False when it is no such cut or the window is floor already. A role's
// statement_timeout shorter than one window failed those walks at the same window every time.
func halvedOnCut(err error, ours bool, window, floor int) (int, bool) {
	if ours || window <= floor || !cutWaiting(err) {
		return window, false
	}
	return max(window/2, floor), true
}

// isConnLost reports whether err means the connection (or the server) is gone, as opposed to
// a statement that failed on a healthy connection.
func isConnLost(err error) bool {
	if err == nil {
		return false
	}
	var pe *pq.Error
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(string(pe.Code), "08"): // connection exception
			return true
		case pe.Code == "57P01", pe.Code == "57P02", pe.Code == "57P03": // shutdown, crash, starting
			return true
		}
		return false
	}
	// A file the driver could not read (certificate, key, passfile) is not a lost connection,
	// however it failed: a syscall.Errno inside it would pass for a net.Error below.
	var fe *fs.PathError
	if errors.As(err, &fe) {
		return false
	}
	var ne net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ENOENT) || errors.As(err, &ne)
}

// backoff is a capped, jittered exponential back-off (River, net/http's tempDelay).
type backoff struct {
	min, max time.Duration
	cur      time.Duration
}

// next returns the next delay: doubled each time up to max, with ±25 % jitter so that
// several dispatchers (or systems) do not retry in lockstep.
func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else if b.cur *= 2; b.cur > b.max {
		b.cur = b.max
	}
	j := time.Duration(rand.Int64N(int64(b.cur)/2+1)) - b.cur/4
	return b.cur + j
}

func (b *backoff) reset() { b.cur = 0 }

// withRetry runs op, re-running it at once after a transient failure (40001/40P01) and after
// a lost connection with back-off, until it succeeds, fails otherwise, or ctx ends, or the
// time budget is spent. It is for statements the coordinator can afford to wait for; the
// coordinator's own loop never blocks on it for longer than budget.
func withRetry(ctx context.Context, budget time.Duration, what string, op func(context.Context) error) error {
	deadline := time.Now().Add(budget)
	b := backoff{min: 50 * time.Millisecond, max: 2 * time.Second}
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if err == nil {
			return nil
		}
		if !isTransient(err) && !isConnLost(err) {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("%s (gave up after %d attempts): %w", what, attempt, err)
		}
		if isTransient(err) {
			continue
		}
		t := time.NewTimer(b.next())
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-t.C:
		}
	}
}

// idList is ids as a bigint[] parameter for "id <> ALL ($n)": an empty array when ids is
// nil, which pq.Array would send as NULL, and "<> ALL (NULL)" keeps no row at all.
func idList(ids []int64) any {
	if ids == nil {
		ids = []int64{}
	}
	return pq.Array(ids)
}
