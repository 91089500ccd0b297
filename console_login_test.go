package main

import (
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestConsoleLoginRefusalsLogged: 200 logins with a wrong credential, from clients at once,
// are each refused, and logged as one line (the first), not 200: a client that tries
// credentials made the daemon's log a line per request, and journald's rate limit then
// dropped the dispatcher's own lines too. The next line, loginRefusedEvery later, says how
// many it left out. The right credential still logs in.
func TestConsoleLoginRefusalsLogged(t *testing.T) {
	h := newConsoleHarness(t, testConsoleToken)
	var log syncBuffer
	h.c.log = slog.New(slog.NewTextHandler(&log, nil))
	cl := h.srv.Client()
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 25 {
				code, _ := h.post(t, cl, "/login", h.srv.URL, url.Values{"token": {"wrong-credential-xxxxxxxxxx"}})
				mu.Lock()
				codes[code]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if codes[403] != 200 {
		t.Fatalf("answers to 200 wrong credentials: %v, want 200 times 403", codes)
	}
	if n := strings.Count(log.String(), "console: login refused"); n != 1 {
		t.Errorf("%d lines for 200 refused logins at once, want 1:\n%s", n, log.String())
	}
	h.c.refused.last = time.Now().Add(-loginRefusedEvery) // the rate limit's period, over
	h.post(t, cl, "/login", h.srv.URL, url.Values{"token": {"wrong-credential-xxxxxxxxxx"}})
	if !strings.Contains(log.String(), "refused_unlogged=199") {
		t.Errorf("the next line does not count the 199 refusals it left out:\n%s", log.String())
	}
	jar, _ := cookiejar.New(nil)
	h.login(t, &http.Client{Jar: jar})
	if !strings.Contains(log.String(), "console: operator logged in") {
		t.Errorf("the right credential did not log in")
	}
}
