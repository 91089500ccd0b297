# dist/install.mk: `make install` and `make uninstall` for pepsi-dispatch.
#
# Included by the top-level Makefile (include dist/install.mk), which defines PREFIX, DESTDIR,
# BINDIR, MANDIR, SHAREDIR, VERSION, GO and the `build` target; it also works on its own:
#     make -f dist/install.mk install DESTDIR=/tmp/stage-root PREFIX=/usr
#
# It installs the binary that `make build` left at the top of the tree (it does not build: run
# `make build` first, as yourself, then `make install` as root):
#     $(BINDIR)/pepsi-dispatch                          the static daemon
#     $(BINDIR)/pepsi-queue                             the operator's command
#     $(MANDIR)/man1/pepsi-dispatch.1, pepsi-queue.1, man5/pepsi.conf.5, man7/pepsi-worker.7
#     $(SHAREDIR)/pepsi.conf.example, schema.sql and the files it includes
#                                                       (PEPSI_SQL), examples/shell-stage
#     $(DOCDIR)/README.md, scale-out.md
#     $(DESTDIR)$(UNITDIR)/pepsi-dispatch.service      ExecStart rewritten to $(BINDIR)
#     $(DESTDIR)$(SYSUSERSDIR)/pepsi.conf               the pepsi account (sysusers.d)
# It never writes /etc: copy pepsi.conf.example to /etc/pepsi/pepsi.conf yourself.
#
# Variables. As in the Makefile, BINDIR, MANDIR, SHAREDIR and DOCDIR include $(DESTDIR);
# UNITDIR and SYSUSERSDIR are the paths on the target system, without it (systemd's own
# directories do not follow PREFIX).
#     MANCOMPRESS=gzip    install the man pages gzipped (default: as they are)

PREFIX      ?= /usr/local
DESTDIR     ?=
BINDIR      ?= $(DESTDIR)$(PREFIX)/bin
MANDIR      ?= $(DESTDIR)$(PREFIX)/share/man
SHAREDIR    ?= $(DESTDIR)$(PREFIX)/share/pepsi
DOCDIR      ?= $(DESTDIR)$(PREFIX)/share/doc/pepsi-dispatch
UNITDIR     ?= /lib/systemd/system
SYSUSERSDIR ?= /usr/lib/sysusers.d
MANCOMPRESS ?=
INSTALL     ?= install

# The tree this file belongs to, so that `make -f` from elsewhere works too.
PEPSI_TOP := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))/..)

# Where the binary lands on the target system (BINDIR without DESTDIR), for the unit.
PEPSI_RUN_BINDIR = $(patsubst $(DESTDIR)%,%,$(BINDIR))

PEPSI_MANS = doc/pepsi-dispatch.1 doc/pepsi-queue.1 doc/pepsi.conf.5 doc/pepsi-worker.7

# schema.sql and every file it includes with \ir: psql looks for those beside schema.sql, so
# they are installed in the same directory. A file added to schema.sql's includes goes here.
PEPSI_SQL = schema.sql fanin.sql operate.sql

.PHONY: install uninstall install-bin install-man install-share install-doc install-systemd

install: install-bin install-man install-share install-doc install-systemd  ## install (PREFIX, DESTDIR); run `make build` first
	@echo "installed. Next: systemd-sysusers; install -d /etc/pepsi;"
	@echo "  install -m 0640 -g pepsi $(PREFIX)/share/pepsi/pepsi.conf.example /etc/pepsi/pepsi.conf (and edit it);"
	@echo "  psql -v ON_ERROR_STOP=1 -f $(PREFIX)/share/pepsi/schema.sql \"\$$DSN\";"
	@echo "  systemctl daemon-reload; systemctl enable --now pepsi-dispatch"

install-bin:
	@test -x $(PEPSI_TOP)/pepsi-dispatch || { \
	    echo "install: $(PEPSI_TOP)/pepsi-dispatch is missing: run 'make build' first" >&2; exit 1; }
	$(INSTALL) -d $(BINDIR)
	$(INSTALL) -m 0755 $(PEPSI_TOP)/pepsi-dispatch $(BINDIR)/pepsi-dispatch
	@test -x $(PEPSI_TOP)/pepsi-queue || { \
	    echo "install: $(PEPSI_TOP)/pepsi-queue is missing: run 'make build' first" >&2; exit 1; }
	$(INSTALL) -m 0755 $(PEPSI_TOP)/pepsi-queue $(BINDIR)/pepsi-queue

install-man:
	@for f in $(PEPSI_MANS); do \
	    sec=$${f##*.}; dir="$(MANDIR)/man$$sec"; \
	    echo "$(INSTALL) -m 0644 $$f $$dir/"; \
	    $(INSTALL) -d "$$dir" && \
	    $(INSTALL) -m 0644 "$(PEPSI_TOP)/$$f" "$$dir/" || exit 1; \
	    if [ "$(MANCOMPRESS)" = gzip ]; then gzip -9nf "$$dir/$${f##*/}" || exit 1; fi; \
	done

install-share:
	$(INSTALL) -d $(SHAREDIR) $(SHAREDIR)/examples
	$(INSTALL) -m 0644 $(PEPSI_TOP)/dist/pepsi.conf.example $(SHAREDIR)/pepsi.conf.example
	$(INSTALL) -m 0644 $(addprefix $(PEPSI_TOP)/,$(PEPSI_SQL)) $(SHAREDIR)/
	$(INSTALL) -m 0755 $(PEPSI_TOP)/doc/examples/shell-stage $(SHAREDIR)/examples/shell-stage

install-doc:
	$(INSTALL) -d $(DOCDIR)
	$(INSTALL) -m 0644 $(PEPSI_TOP)/README.md $(PEPSI_TOP)/doc/scale-out.md $(DOCDIR)/

install-systemd:
	$(INSTALL) -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR)
	sed 's|/usr/local/bin/pepsi-dispatch|$(PEPSI_RUN_BINDIR)/pepsi-dispatch|' \
	    $(PEPSI_TOP)/dist/pepsi-dispatch.service > $(DESTDIR)$(UNITDIR)/pepsi-dispatch.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/pepsi-dispatch.service
	$(INSTALL) -m 0644 $(PEPSI_TOP)/dist/pepsi.sysusers $(DESTDIR)$(SYSUSERSDIR)/pepsi.conf

uninstall:  ## remove what install installed (not /etc/pepsi, not the pepsi account)
	rm -f $(BINDIR)/pepsi-dispatch $(BINDIR)/pepsi-queue
	rm -f $(MANDIR)/man1/pepsi-queue.1 $(MANDIR)/man1/pepsi-queue.1.gz
	rm -f $(MANDIR)/man1/pepsi-dispatch.1 $(MANDIR)/man1/pepsi-dispatch.1.gz
	rm -f $(MANDIR)/man5/pepsi.conf.5 $(MANDIR)/man5/pepsi.conf.5.gz
	rm -f $(MANDIR)/man7/pepsi-worker.7 $(MANDIR)/man7/pepsi-worker.7.gz
	rm -f $(SHAREDIR)/pepsi.conf.example $(addprefix $(SHAREDIR)/,$(PEPSI_SQL)) $(SHAREDIR)/examples/shell-stage
	rmdir $(SHAREDIR)/examples $(SHAREDIR) 2>/dev/null || true
	rm -f $(DOCDIR)/README.md $(DOCDIR)/scale-out.md
	rmdir $(DOCDIR) 2>/dev/null || true
	rm -f $(DESTDIR)$(UNITDIR)/pepsi-dispatch.service
	rm -f $(DESTDIR)$(SYSUSERSDIR)/pepsi.conf
