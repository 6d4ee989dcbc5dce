-- The subscriber's side of the one-round-trip apply (replica/inline.py).

-- pgcascade.apply_begin(queue, prev_tick, prev_position, cur_tick, cur_position, provider,
--                       node_type) -> void: in a batch's apply transaction, before anything else
-- of it runs to completion: locks the node row (a batch in flight elsewhere is waited for),
-- checks that the batch starts where this node's record says it is - its tick, and its
-- position between ticks (53_position.sql; null: at the tick) - and that the node still reads
-- the same provider as the same type, and records where the batch ends - so the rest of the
-- batch can follow in the same pipeline, and the whole transaction fails if the check does:
--   SQLSTATE PCRES: the node's record is elsewhere (the detail is its last tick): nothing is
--                   applied, the worker puts its consumer back there
--   SQLSTATE PCMOV: the node moved (change-provider, takeover) since the round began
-- (the release before it had no positions)
drop function if exists pgcascade.apply_begin(text, int8, int8, text, text);
create or replace function pgcascade.apply_begin(
    i_queue_name text, i_prev_tick int8, i_prev_position text, i_cur_tick int8, i_cur_position text,
    i_provider text, i_node_type text)
returns void
language plpgsql as $$
declare
    n pgcascade.node;
begin
    select * into n from pgcascade.node where queue_name = i_queue_name for update;
    if not found then
        raise exception 'this database is not a node of set "%"', i_queue_name using errcode = 'P0002';
    end if;
    if n.provider_node is distinct from i_provider or n.node_type <> i_node_type then
        raise exception 'node % moved: provider %, type %', n.node_name, n.provider_node, n.node_type
            using errcode = 'PCMOV';
    end if;
    if n.last_tick is not null
       and (n.last_tick <> i_prev_tick or n.last_position is distinct from i_prev_position) then
        raise exception 'node % applied up to tick % (position %), the batch starts at % (position %)',
            n.node_name, n.last_tick, coalesce(n.last_position, 'at the tick'), i_prev_tick,
            coalesce(i_prev_position, 'at the tick')
            using errcode = 'PCRES', detail = n.last_tick::text;
    end if;
    update pgcascade.node set last_tick = i_cur_tick, last_position = i_cur_position, last_error = null,
                              last_error_time = null
     where queue_name = i_queue_name;
end $$;

-- pgcascade.expect_rows(n, expected) -> true: checks the row count of an update shaped for a
-- small batch (replica/applysql.py, one_kind_sql), which holds only if every key it updates is
-- here:
--   SQLSTATE PCROW: it wrote `n` rows, not `expected`; the batch is applied again the general way
create or replace function pgcascade.expect_rows(n int8, expected int8) returns bool
language plpgsql as $$
begin
    if n <> expected then
        raise exception 'the statement wrote % rows, not %', n, expected using errcode = 'PCROW';
    end if;
    return true;
end $$;
