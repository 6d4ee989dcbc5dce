-- Trigger capture of a partitioned table (docs/replication.md, "Partitioned tables").
--
-- A statement-level trigger with transition tables on the partitioned table sees every row a
-- statement naming the table writes, whatever partition it lands in - partitions attached
-- later included - and PostgreSQL allows such triggers on partitioned tables and on partitions
-- (not row-level ones with transition tables).  But a statement that names a partition fires
-- that partition's statement triggers only, not its parent's.  So:
--
-- * the table gets the capture triggers of 90_capture.sql (their events carry its name);
-- * every partition gets the same INSERT/UPDATE/DELETE statement triggers, calling the same
--   functions (which name the partitioned table in the events and do nothing for a table
--   detached since): a write naming a partition is captured set-based too;
-- * a partition attached after that has none yet: the ticker's maintenance gives them to it
--   (maint_capture_partitions, every maint_period), as does add-table.  Until then a row-level
--   guard refuses a write naming it.  PostgreSQL clones row-level triggers of a partitioned
--   table onto every partition, present and future, so the guard needs no set-up; it is
--   disabled on each partition that has its capture triggers.  Rows a statement on the
--   partitioned table (or on an inner partitioned partition that has its triggers) routes into
--   a new partition must pass: a BEFORE STATEMENT trigger there sets the mark
--   'pgcascade.via_<table oid>_<depth>' for the statement's trigger depth, the guard's WHEN
--   clause lets a row through when its depth is marked, and the capture functions clear the
--   mark at the statement's end.
--
-- TRUNCATE of one partition, DETACH and DROP PARTITION, and ATTACH of a table with rows change
-- the partitioned table's rows without a row event: they are not replicated (native logical
-- replication with publish_via_partition_root does not either).

-- pgcascade.partition_mark_name(table) -> the custom setting that marks, per trigger depth, a
-- statement on the partitioned `table` (or an inner partition of it) in progress.
create or replace function pgcascade.partition_mark_name(i_table regclass) returns text
language sql immutable as $$
    select 'pgcascade.via_' || i_table::oid || '_'
$$;

-- pgcascade.partition_functions(table) -> void: (re)create the mark and guard functions of a
-- partitioned table (called by capture_functions).  They touch nothing of pgcascade's, so they
-- run as the writer, without the GUC save and restore per call of a SECURITY DEFINER function's
-- SET search_path, with every name qualified, so no search_path of the writer's changes what
-- they do.  The mark costs ~9 us of backend CPU per statement on the partitioned table
-- (single-row INSERTs with capture: 70 against 61 us, measured here).
create or replace function pgcascade.partition_functions(i_table regclass) returns void
language plpgsql as $$
declare
    fn text := 'capture_' || i_table::oid;
begin
    execute format('create or replace function pgcascade.%I() returns trigger language plpgsql as %L',
        fn || '_mark', format($f$
begin
    if TG_RELID operator(pg_catalog.=) %s::pg_catalog.oid
       or pg_catalog.pg_partition_root(TG_RELID) operator(pg_catalog.=) %s::pg_catalog.oid::pg_catalog.regclass then
        perform pg_catalog.set_config(%L operator(pg_catalog.||) (pg_catalog.pg_trigger_depth() operator(pg_catalog.-) 1),
                                      'on', true);
    end if;
    return null;
end $f$, i_table::oid, i_table::oid, pgcascade.partition_mark_name(i_table)));
    execute format('create or replace function pgcascade.%I() returns trigger language plpgsql as %L',
        fn || '_guard', format($f$
begin
    raise exception 'partition %%.%% of replicated table %% has no capture triggers yet: write through %%,'
                    ' or run add-table %% on the root (the ticker adds them within its maint_period)',
        pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), %1$L, %1$L, %1$L
        using errcode = '55000';
end $f$, pgcascade.canonical_name(i_table)));
    execute format('revoke all on function pgcascade.%I() from public', fn || '_mark');
    execute format('revoke all on function pgcascade.%I() from public', fn || '_guard');
end $$;

-- pgcascade.capture_partitions(table) -> partitions given their capture triggers now: the
-- partitioned table's mark and guard triggers, then every partition without capture triggers
-- gets them (an inner partitioned one its mark too; a leaf's guard is disabled).  Triggers left
-- on a table detached since are dropped.  A table that is not partitioned: 0.
create or replace function pgcascade.capture_partitions(i_table regclass) returns int4
language plpgsql as $$
declare
    fn text := 'capture_' || i_table::oid;
    r record;
    op text;
    n int4 := 0;
begin
    if (select relkind from pg_class where oid = i_table) <> 'p' then
        return 0;
    end if;
    perform pgcascade.capture_partitions_drop(i_table, false);
    if not exists (select 1 from pg_trigger where tgrelid = i_table and tgname = '_pgcascade_partmark') then
        execute format('create trigger _pgcascade_partmark before insert or update or delete on %s'
                       ' for each statement execute function pgcascade.%I()', i_table, fn || '_mark');
    end if;
    if not exists (select 1 from pg_trigger where tgrelid = i_table and tgname = '_pgcascade_partguard') then
        execute format('create trigger _pgcascade_partguard before insert or update or delete on %s for each row'
                       ' when (current_setting(%L || pg_trigger_depth(), true) is distinct from ''on'')'
                       ' execute function pgcascade.%I()', i_table, pgcascade.partition_mark_name(i_table), fn || '_guard');
    end if;
    for r in select t.relid::regclass as rel, c.relkind
               from pg_partition_tree(i_table) t join pg_class c on c.oid = t.relid
              where t.level > 0 and c.relkind in ('r', 'p')
                and not exists (select 1 from pg_trigger g where g.tgrelid = t.relid and g.tgname = '_pgcascade_capture_ins')
              order by t.level
    loop
        execute format('create trigger _pgcascade_capture_ins after insert on %s referencing new table as pgcascade_new'
                       ' for each statement execute function pgcascade.%I()', r.rel, fn || '_ins');
        execute format('create trigger _pgcascade_capture_upd after update on %s'
                       ' referencing new table as pgcascade_new old table as pgcascade_old'
                       ' for each statement execute function pgcascade.%I()', r.rel, fn || '_upd');
        execute format('create trigger _pgcascade_capture_del after delete on %s referencing old table as pgcascade_old'
                       ' for each statement execute function pgcascade.%I()', r.rel, fn || '_del');
        if r.relkind = 'p' then
            execute format('create trigger _pgcascade_partmark before insert or update or delete on %s'
                           ' for each statement execute function pgcascade.%I()', r.rel, fn || '_mark');
        else
            execute format('alter table only %s disable trigger _pgcascade_partguard', r.rel);
        end if;
        n := n + 1;
    end loop;
    return n;
end $$;

-- pgcascade.capture_partitions_drop(table, all) -> void: drop the partition triggers that call
-- `table`'s capture functions: from tables detached from it since, or (`all`) from every
-- partition too.
create or replace function pgcascade.capture_partitions_drop(i_table regclass, i_all bool) returns void
language plpgsql as $$
declare
    r record;
    t text;
begin
    if to_regprocedure(format('pgcascade.%I()', 'capture_' || i_table::oid || '_ins')) is null then
        return;
    end if;
    for r in select distinct g.tgrelid::regclass as rel from pg_trigger g
              where g.tgfoid = to_regprocedure(format('pgcascade.%I()', 'capture_' || i_table::oid || '_ins'))
                and g.tgrelid <> i_table
                and (i_all or pg_partition_root(g.tgrelid) is distinct from i_table)
    loop
        foreach t in array array['_pgcascade_capture_ins', '_pgcascade_capture_upd', '_pgcascade_capture_del',
                                 '_pgcascade_partmark'] loop
            execute format('drop trigger if exists %I on %s', t, r.rel);
        end loop;
    end loop;
end $$;

-- pgcascade.maint_capture_partitions(queue) -> partitions set up: the ticker's maintenance.
-- Partitions attached since to the queue's partitioned tables get their capture triggers
-- (trigger capture) or, where the table has REPLICA IDENTITY FULL, that identity (logical
-- capture: pgoutput logs an UPDATE's or DELETE's old row by the partition's own identity).  A
-- partition whose lock does not come within 200 ms is left for the next round.
create or replace function pgcascade.maint_capture_partitions(i_queue text) returns int4
language plpgsql as $$
declare
    t record;
    n int4 := 0;
    v_old_timeout text := current_setting('lock_timeout');
begin
    perform set_config('lock_timeout', '200ms', true);
    for t in select to_regclass(st.table_name) as rel from pgcascade.set_table st
              where st.queue_name = i_queue
                and (select relkind from pg_class where oid = to_regclass(st.table_name)) = 'p'
    loop
        begin
            if exists (select 1 from pg_trigger where tgrelid = t.rel and tgname = '_pgcascade_capture_ins') then
                n := n + pgcascade.capture_partitions(t.rel);
            elsif exists (select 1 from pgcascade.walcapture where queue_name = i_queue)
                  and (select relreplident from pg_class where oid = t.rel) = 'f' then
                n := n + pgcascade.walcapture_full_identity(t.rel);
            end if;
        exception when lock_not_available then
            null;  -- the next round
        end;
    end loop;
    perform set_config('lock_timeout', v_old_timeout, true);
    return n;
end $$;
