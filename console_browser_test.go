// console_browser_test.go: the web console in a real browser. Headless Chromium, driven
// through chromedriver's WebDriver protocol (plain JSON over HTTP, so no dependency), against
// a real daemon running a three-stage pipeline: load every page and take a screenshot, check
// that the DOM shows the stages and a failure group, log in, retry the group through its form
// and check the rows changed, delete a group of more than 1,000 through its confirmation page,
// pause and resume a stage; then the same through a reverse proxy under a path of its own.
//
// It needs Debian's chromium and chromium-driver; without them it skips, except under CI=true
// where it fails. PEPSI_CONSOLE_SCREENSHOTS=DIR keeps the screenshots (doc/console.png is the
// overview's, made so).

package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// webDriver is one WebDriver session.
type webDriver struct {
	t       *testing.T
	base    string // chromedriver's address
	session string
}

// call sends one WebDriver command and decodes its "value" into out (nil: ignored).
func (wd *webDriver) call(method, path string, in, out any) {
	wd.t.Helper()
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, wd.base+path, body)
	if err != nil {
		wd.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		wd.t.Fatalf("webdriver %s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		wd.t.Fatalf("webdriver %s %s: %s: %s", method, path, resp.Status, raw)
	}
	if out != nil {
		var env struct{ Value json.RawMessage }
		if err := json.Unmarshal(raw, &env); err != nil {
			wd.t.Fatalf("webdriver %s %s: decode: %v", method, path, err)
		}
		if err := json.Unmarshal(env.Value, out); err != nil {
			wd.t.Fatalf("webdriver %s %s: decode value: %v", method, path, err)
		}
	}
}

func (wd *webDriver) s(path string) string { return "/session/" + wd.session + path }

func (wd *webDriver) open(url string) {
	wd.call("POST", wd.s("/url"), map[string]string{"url": url}, nil)
}

func (wd *webDriver) source() string {
	var src string
	wd.call("GET", wd.s("/source"), nil, &src)
	return src
}

// find returns the first element matching a CSS selector.
func (wd *webDriver) find(css string) string {
	wd.t.Helper()
	var el map[string]string
	wd.call("POST", wd.s("/element"), map[string]string{"using": "css selector", "value": css}, &el)
	for _, id := range el {
		return id
	}
	wd.t.Fatalf("no element for %s", css)
	return ""
}

func (wd *webDriver) click(css string) {
	wd.call("POST", wd.s("/element/"+wd.find(css)+"/click"), map[string]any{}, nil)
}

// url is the address of the page the browser shows.
func (wd *webDriver) url() string {
	var u string
	wd.call("GET", wd.s("/url"), nil, &u)
	return u
}

// css is the computed value of a CSS property of the first element matching a selector.
func (wd *webDriver) css(selector, property string) string {
	var v string
	wd.call("GET", wd.s("/element/"+wd.find(selector)+"/css/"+property), nil, &v)
	return v
}

func (wd *webDriver) typeInto(css, text string) {
	wd.call("POST", wd.s("/element/"+wd.find(css)+"/value"), map[string]string{"text": text}, nil)
}

// screenshot saves the page as name.png in dir and returns the PNG's size.
func (wd *webDriver) screenshot(dir, name string) int {
	var b64 string
	wd.call("GET", wd.s("/screenshot"), nil, &b64)
	png, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		wd.t.Fatalf("screenshot of %s is not a PNG (%v)", name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644); err != nil {
		wd.t.Fatal(err)
	}
	return len(png)
}

// startBrowser starts chromedriver and one headless Chromium session.
func startBrowser(t *testing.T) *webDriver {
	t.Helper()
	const checks, install = "the console's test in a real browser", "apt-get install -y chromium chromium-driver"
	browser := referenceTool(t, "", "chromium", checks, install)
	driver := referenceTool(t, "", "chromedriver", checks, install)
	_, port, _ := net.SplitHostPort(freePort(t))
	cmd := exec.Command(driver, "--port="+port)
	var log syncBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start chromedriver: %v", err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("chromedriver log:\n%s", log.String())
		}
	})
	wd := &webDriver{t: t, base: "http://127.0.0.1:" + port}
	waitFor(t, 30*time.Second, "chromedriver ready", func() bool {
		resp, err := http.Get(wd.base + "/status")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	profile := t.TempDir()
	var sess struct {
		SessionID string `json:"sessionId"`
	}
	wd.call("POST", "/session", map[string]any{"capabilities": map[string]any{"alwaysMatch": map[string]any{
		"browserName": "chrome",
		"goog:chromeOptions": map[string]any{"binary": browser, "args": []string{
			"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
			"--disable-background-networking", "--disable-component-update", "--disable-sync",
			"--disable-dev-shm-usage", "--user-data-dir=" + profile, "--window-size=1280,900"}},
	}}}, &sess)
	wd.session = sess.SessionID
	t.Cleanup(func() { wd.call("DELETE", wd.s(""), nil, nil) })
	return wd
}

func TestConsoleBrowser(t *testing.T) {
	wd := startBrowser(t)
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	dir := testDir(t)
	token := filepath.Join(dir, "console.token")
	if err := os.WriteFile(token, []byte(testConsoleToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	conf := baseConf(s, fmt.Sprintf("METRICS_LISTEN = %s\nCONSOLE_TOKEN_FILE = %s", addr, token)) +
		stageConf(t, "parse", "enrich", "") + stageConf(t, "enrich", "deliver", "") +
		stageConf(t, "deliver", "", "MAX_ATTEMPTS = 1")
	// 20 messages go through; 10 fail once at deliver (fail_n 1) and so succeed when retried.
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{}' FROM generate_series(1, 20)`)
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'parse', '{"fail_at": "deliver", "fail_n": 1}' FROM generate_series(1, 10)`)
	d := startDaemon(t, conf, "pipeline")
	defer d.stop()
	waitFor(t, 60*time.Second, "20 done and 10 failed", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == 20 &&
			s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'failed'`) == 10
	})
	shots := os.Getenv("PEPSI_CONSOLE_SCREENSHOTS")
	if shots == "" {
		shots = t.TempDir()
	}
	base := "http://" + addr

	// The overview shows the three stages (and their failed count) to anyone.
	wd.open(base + "/")
	src := wd.source()
	for _, st := range []string{"parse", "enrich", "deliver"} {
		if !strings.Contains(src, `id="stage-`+st+`"`) {
			t.Errorf("the overview shows no stage %s", st)
		}
	}
	if !strings.Contains(src, `href="./search?stage=deliver&amp;status=failed">10<`) {
		t.Errorf("the overview does not count deliver's 10 failed messages")
	}
	wd.screenshot(shots, "overview")

	// The failures page shows one group of 10, and no action before logging in.
	wd.open(base + "/failures")
	src = wd.source()
	if !strings.Contains(src, "asked to fail at deliver") || !strings.Contains(src, `<td class="n">10</td>`) {
		t.Fatalf("the failures page shows no group of 10 for deliver's failure:\n%s", src)
	}
	if strings.Contains(src, `value="retry"`) {
		t.Fatal("the failures page offers a retry before logging in")
	}
	wd.screenshot(shots, "failures")

	// Log in through the header's form, then retry the group through its form.
	wd.typeInto(`input[name="token"]`, testConsoleToken)
	wd.click(`form.login button`)
	// The click submits the form; wait for the page it leads to (the header then offers to
	// log out) before opening another, or the open would cut the login short.
	waitFor(t, 15*time.Second, "the logged-in page", func() bool {
		return strings.Contains(wd.source(), `action="./logout"`)
	})
	wd.open(base + "/failures")
	wd.click(`form button[value="retry"]`)
	waitFor(t, 15*time.Second, "the retry's result shown", func() bool {
		return strings.Contains(wd.source(), "retry: 10 changed")
	})
	wd.screenshot(shots, "failures-retried")
	waitFor(t, 60*time.Second, "the retried group done", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == 30
	})
	if n := s.count(t, `SELECT count(*) FROM operator_log WHERE action = 'retry' AND os_user = 'console' AND changed = 10`); n != 1 {
		t.Errorf("operator_log has %d retry entries of 10 rows by the console, want 1", n)
	}

	// A group of more than 1,000 asks first: its own page, whose button acts.
	s.exec(t, `INSERT INTO workqueue (stage, status, attempts, state)
		SELECT 'deliver', 'failed', 1, '{"dispatch_error": "bounced by example.org"}' FROM generate_series(1, 1001)`)
	wd.open(base + "/failures")
	wd.click(`form:has(input[name="count"][value="1001"]) button[value="delete"]`)
	waitFor(t, 15*time.Second, "the confirmation page", func() bool {
		return strings.Contains(wd.source(), "more than 1,000 messages (1001 when the failures page counted them)")
	})
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE state->>'dispatch_error' = 'bounced by example.org'`); n != 1001 {
		t.Fatalf("%d of the group's 1,001 rows left before confirming", n)
	}
	wd.screenshot(shots, "confirm")
	wd.click(`form.actions button`)
	waitFor(t, 15*time.Second, "the confirmed delete's result", func() bool {
		return strings.Contains(wd.source(), "delete: 1001 changed")
	})
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE state->>'dispatch_error' = 'bounced by example.org'`); n != 0 {
		t.Errorf("%d of the group's rows left after the confirmed delete", n)
	}

	// Pause and resume a stage from the stages page.
	wd.open(base + "/stages")
	wd.screenshot(shots, "stages")
	wd.click(`form input[value="enrich"] ~ button[value="pause"]`)
	waitFor(t, 15*time.Second, "the pause's result shown", func() bool {
		return strings.Contains(wd.source(), "stage enrich paused")
	})
	waitFor(t, 10*time.Second, "enrich paused in the config table", func() bool {
		return s.count(t, `SELECT count(*) FROM config WHERE section = 'stage-enrich' AND upper(key) = 'PAUSED' AND lower(value) = 'yes'`) == 1
	})
	wd.open(base + "/stages")
	wd.click(`form input[value="enrich"] ~ button[value="resume"]`)
	waitFor(t, 15*time.Second, "the resume's result shown", func() bool {
		return strings.Contains(wd.source(), "stage enrich resumed")
	})
	waitFor(t, 10*time.Second, "enrich resumed", func() bool {
		return s.count(t, `SELECT count(*) FROM config WHERE section = 'stage-enrich' AND upper(key) = 'PAUSED' AND lower(value) = 'yes'`) == 0
	})

	// Behind a reverse proxy that serves the console under /pepsi/ and takes the prefix off,
	// reached by another host name (localhost: the login above is not sent there): a page one
	// level down keeps its style, its links lead to the console under the prefix, and a login
	// and an action come back there.
	proxy := pathProxy(t, base)
	pbase := strings.Replace(proxy.URL, "127.0.0.1", "localhost", 1) + "/pepsi/"
	wd.open(pbase + "message/25")
	if d := wd.css("header", "display"); d != "flex" {
		t.Errorf("through the proxy, the header's display is %q: the stylesheet did not load", d)
	}
	wd.click(`nav a[href$="failures"]`)
	waitFor(t, 15*time.Second, "the failures page under the proxy's prefix", func() bool { return wd.url() == pbase+"failures" })
	wd.typeInto(`input[name="token"]`, testConsoleToken)
	wd.click(`form.login button`)
	waitFor(t, 15*time.Second, "the logged-in overview under the proxy's prefix", func() bool {
		return wd.url() == pbase && strings.Contains(wd.source(), `action="./logout"`)
	})
	wd.open(pbase + "stages")
	wd.click(`form input[value="enrich"] ~ button[value="pause"]`)
	// The result is shown, and taken out of the address (a reload does not show it again).
	waitFor(t, 15*time.Second, "the pause's result on the stages page under the prefix, out of its address", func() bool {
		return wd.url() == pbase+"stages" && strings.Contains(wd.source(), "stage enrich paused")
	})
	wd.call("POST", wd.s("/refresh"), map[string]any{}, nil)
	if src := wd.source(); strings.Contains(src, "stage enrich paused") {
		t.Errorf("a reload of the stages page shows the last action's result again")
	}
	wd.click(`form input[value="enrich"] ~ button[value="resume"]`)
	waitFor(t, 15*time.Second, "the resume's result", func() bool {
		return strings.Contains(wd.source(), "stage enrich resumed")
	})
	waitFor(t, 10*time.Second, "enrich resumed", func() bool {
		return s.count(t, `SELECT count(*) FROM config WHERE section = 'stage-enrich' AND upper(key) = 'PAUSED' AND lower(value) = 'yes'`) == 0
	})
	wd.click(`header form button`) // log out
	waitFor(t, 15*time.Second, "logged out, at the overview under the prefix", func() bool {
		return wd.url() == pbase && strings.Contains(wd.source(), `class="inline login"`)
	})

	// The other pages load and render.
	for name, path := range map[string]string{"search": "/search?stage=deliver", "message": "/message/25"} {
		wd.open(base + path)
		if src := wd.source(); !strings.Contains(src, "<h1>") || strings.Contains(src, `class="error"`) {
			t.Errorf("%s does not render:\n%s", path, src)
		}
		wd.screenshot(shots, name)
	}
	// A phone-sized screen renders the overview too.
	wd.call("POST", wd.s("/window/rect"), map[string]int{"width": 390, "height": 844}, nil)
	wd.open(base + "/")
	wd.screenshot(shots, "overview-phone")
}
