package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestConsoleFailuresManySignatures: errors that name a tenant, a customer or a file in words
// (which no signature rule takes out) make a signature each: 20,000 failed messages of 20,000
// tenants, and 50 of one error. The failures page listed every group, each with its example
// error and three forms. It shows the consoleFailureGroups biggest, the one of 50 first, and
// says how many signatures and messages it leaves out and what lists them all.
func TestConsoleFailuresManySignatures(t *testing.T) {
	h := newConsoleHarness(t, "")
	s := h.s
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, state)
	    SELECT 'a', '{}', 'failed', jsonb_build_object('dispatch_error',
	           'stage a: status 1: tenant ' || translate(md5(g::text), '0123456789', 'ghijklmnop') || ' refused the delivery')
	      FROM generate_series(1, 20000) g`)
	s.exec(t, `INSERT INTO workqueue (stage, payload, status, state)
	    SELECT 'a', '{}', 'failed', '{"dispatch_error": "stage a: status 1: the relay is down"}' FROM generate_series(1, 50)`)
	resp, err := http.Get(h.srv.URL + "/failures")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	page := string(b)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /failures: %s\n%s", resp.Status, lastLines(page, 5))
	}
	t.Logf("the failures page: %d bytes", len(page))
	if n := strings.Count(page, "<tr><td><code>"); n != consoleFailureGroups {
		t.Errorf("the failures page lists %d groups, want %d", n, consoleFailureGroups)
	}
	if i, j := strings.Index(page, "the relay is down"), strings.Index(page, "refused the delivery"); i < 0 || j < i {
		t.Errorf("the biggest group (50 messages) is not listed first")
	}
	if want := "<b>19901</b> more signatures, <b>19901</b> messages"; !strings.Contains(page, want) {
		t.Errorf("the failures page does not say %q", want)
	}
	if !strings.Contains(page, "pepsi-queue errors") {
		t.Errorf("the failures page does not say what lists every signature")
	}
}
