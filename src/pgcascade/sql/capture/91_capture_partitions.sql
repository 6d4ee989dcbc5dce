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
--   capture trigger covers it: PostgreSQL clones row-level triggers of a partitioned table
--   onto every partition, present and future, so it needs no set-up, and it is disabled on
--   each partition that has its statement triggers.  A row written there through the table is
--   captured twice, the same image (the statement trigger's event, applied last, wins); an
--   UPDATE that changes a key there is refused until the partition is set up (captured row by
--   row, a shift of keys between rows would lose rows).
--
-- TRUNCATE of one partition, DETACH and DROP PARTITION, and ATTACH of a table with rows change
-- the partitioned table's rows without a row event: they are not replicated (native logical
-- replication with publish_via_partition_root does not either).

-- pgcascade.capture_partitions(table) -> partitions given their capture triggers now: the
-- partitioned table's row-level trigger for partitions without them, then every partition
-- without capture triggers gets them (a leaf's row-level one is disabled).  Triggers left on a
-- table detached since are dropped.  A table that is not partitioned: 0.
create or replace function pgcascade.capture_partitions(i_table regclass) returns int4
language plpgsql as $$
declare
    fn text := 'capture_' || i_table::oid;
    r record;
    n int4 := 0;
begin
    if (select relkind from pg_class where oid = i_table) <> 'p' then
        return 0;
    end if;
    perform pgcascade.capture_partitions_drop(i_table, false);
    if not exists (select 1 from pg_trigger where tgrelid = i_table and tgname = '_pgcascade_capture_row') then
        execute format('create trigger _pgcascade_capture_row after insert or update or delete on %s'
                       ' for each row execute function pgcascade.%I()', i_table, fn || '_row');
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
        if r.relkind = 'r' then  -- the clone on an inner partitioned one never fires
            execute format('alter table only %s disable trigger _pgcascade_capture_row', r.rel);
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
        foreach t in array array['_pgcascade_capture_ins', '_pgcascade_capture_upd', '_pgcascade_capture_del'] loop
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
