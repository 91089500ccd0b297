// listen.go: the LISTEN connection (lib/pq's Listener), and keeping the server from ending it
// for being idle.
//
// A role's idle_session_timeout (PostgreSQL 14) ends a session that has sent nothing for that
// long. The LISTEN connection sends nothing while it only receives notifications, busy or not,
// so the server ended it at every timeout: a warning, a reconnect, and a claim, a retry pass
// and a re-read of the configuration each time (coordinator.onNotify's nil), for as long as the
// dispatcher ran (TestIdleSessionTimeout). The dispatcher's other sessions turn the timeout off
// for themselves (internal/pgsession), but the Listener opens its own connections and takes no
// statement but LISTEN and its Ping, and a startup parameter in its DSN would be refused by a
// pooler in session mode (doc/scale-out.md). So the keeper pings it, at half the timeout:
// the timeout a new session of the role gets, read when the dispatcher starts, or, once the
// server has ended the connection for idleness (SQLSTATE 57P05: the role's setting changed
// since), half the time that connection lived. Without a timeout (the default) it sends
// nothing: an idle dispatcher's one statement per POLL_INTERVAL stays the only one.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/lib/pq"

	"pepsi-dispatch/internal/pgsession"
)

// listenChannels are the channels the dispatcher LISTENs on.
var listenChannels = []string{"workqueue", "config_changed", "workqueue_cancel"}

// minListenPing keeps an absurdly short timeout from turning the keeper into a busy loop.
const minListenPing = 100 * time.Millisecond

// listenEvent is one of the Listener's connection events, as its callback saw it.
type listenEvent struct {
	kind pq.ListenerEventType
	err  error
	at   time.Time
}

// listener is the LISTEN connection and the goroutine that keeps it from idling.
type listener struct {
	*pq.Listener
	events chan listenEvent
	stop   context.CancelFunc
	wg     sync.WaitGroup
}

// openListener opens the LISTEN connection of this run, listens on listenChannels and starts its
// keeper. work, the pool's sessions, tells the role's idle_session_timeout. close stops both.
func openListener(ctx context.Context, cfg *Config, inst *instance, work *sql.DB, log *slog.Logger) (*listener, error) {
	l := &listener{events: make(chan listenEvent, 16)}
	l.Listener = pq.NewDialListener(pgsession.DialerFor(cfg.DSN, cfg.Dispatch.LockKeepalive), dsnWith(dsnOwn(cfg.DSN), "application_name", inst.appName(appDispatch)),
		100*time.Millisecond, listenerMaxReconnect, func(ev pq.ListenerEventType, err error) {
			switch ev {
			case pq.ListenerEventDisconnected:
				log.Warn("LISTEN connection lost; reconnecting", "err", err)
			case pq.ListenerEventReconnected:
				log.Info("LISTEN connection back")
			case pq.ListenerEventConnectionAttemptFailed:
				log.Debug("LISTEN reconnect failed", "err", err)
			}
			if ev == pq.ListenerEventConnectionAttemptFailed {
				return // many in an outage, and nothing the keeper needs
			}
			select {
			case l.events <- listenEvent{ev, err, time.Now()}:
			default: // the keeper is behind by 16 events: it misses a lifetime, not a ping
			}
		})
	abandon := func() {
		go func() { // the Listener's sender would block on an undrained channel
			for range l.Notify {
			}
		}()
		l.Listener.Close()
	}
	for _, ch := range listenChannels {
		if err := l.Listen(ch); err != nil {
			abandon()
			return nil, fmt.Errorf("listen on channel %s: %w", ch, err)
		}
	}
	timeout, err := roleIdleTimeout(ctx, work)
	if err != nil {
		abandon()
		return nil, err
	}
	kctx, stop := context.WithCancel(ctx)
	l.stop = stop
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.keep(kctx, timeout/2, time.Now(), log)
	}()
	return l, nil
}

// roleIdleTimeout returns the idle_session_timeout a new session of the role gets (reset_val:
// the role's, the database's and the server's settings, before pgsession's SET), 0 when there
// is none or the server has no such setting (before PostgreSQL 14).
func roleIdleTimeout(ctx context.Context, db *sql.DB) (time.Duration, error) {
	var ms int64
	err := db.QueryRowContext(ctx, `SELECT coalesce((SELECT reset_val::bigint FROM pg_settings
		 WHERE name = 'idle_session_timeout'), 0)`).Scan(&ms)
	if err != nil {
		return 0, fmt.Errorf("read the role's idle_session_timeout: %w", err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// keep pings the connection every `every` (none while it is 0). since is when the connection
// was made.
func (l *listener) keep(ctx context.Context, every time.Duration, since time.Time, log *slog.Logger) {
	// A stopped ticker never fires: it is started (Reset) once there is a timeout to beat.
	ticker := time.NewTicker(time.Hour)
	ticker.Stop()
	defer ticker.Stop()
	setEvery := func(d time.Duration) {
		every = max(d, minListenPing)
		ticker.Reset(every)
	}
	if every > 0 {
		setEvery(every)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			// An error means no connection now: the Listener is making it again by itself.
			_ = l.Ping()
		case ev := <-l.events:
			switch ev.kind {
			case pq.ListenerEventConnected, pq.ListenerEventReconnected:
				since = ev.at
			case pq.ListenerEventDisconnected:
				var pe *pq.Error
				if !errors.As(ev.err, &pe) || pe.Code != "57P05" {
					continue
				}
				lived := ev.at.Sub(since)
				if every == 0 || lived/2 < every {
					setEvery(lived / 2)
					log.Info("the server ends idle sessions (idle_session_timeout): the LISTEN connection is pinged from now on",
						"every", every)
				}
			}
		}
	}
}

// close stops the keeper, then the Listener. The caller drains Notify meanwhile (main.go).
func (l *listener) close() {
	l.stop()
	l.wg.Wait()
	l.Listener.Close()
}
